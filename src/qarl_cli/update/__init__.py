"""The update stage (TBPO and its baselines): the learner (policy, optimizer, minibatch updates, data
parallelism under torchrun), rollouts packed as tensors (sequences), the objectives as pure functions
(objectives), group-normalised advantages, the rollout-mismatch metrics and what routing replay changes
(routing_agreement). The optimizer is qarl_cli.optim: the tiny models' warm start uses it too."""
