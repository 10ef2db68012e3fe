from . import parallel_state as parallel_state
