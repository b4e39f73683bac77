"""GLM-5.3-Flash (glm5_next: KDA + DSA hybrid with mHC hyper-connections, MoE, vision tower) on Megatron-core.

config.py reads the architecture, tiny.py holds the tests' tiny configs; the family registers once its token
mixers (kda.py, attention.py) are in."""
