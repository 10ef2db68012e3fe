from . import parallel_state as parallel_state
from . import tensor_parallel as tensor_parallel
from . import utils as utils
