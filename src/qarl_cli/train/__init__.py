"""`qarl train`: the RL loop (loop.py) and what it calls that is not a stage of its own: the learner (policy,
optimizer, update), the packing of rollouts into tensors, the train state (checkpoints, resume) and the loggers."""
