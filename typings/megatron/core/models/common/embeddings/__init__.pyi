from . import rotary_pos_embedding as rotary_pos_embedding
