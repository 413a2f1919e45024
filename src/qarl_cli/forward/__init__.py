"""The aligned forward stage: the policy's linears replaced by the scheme's quantized modules (aligned), or left
in bf16 (forward=bf16); per-token logprobs of given sequences (logprobs), what the learner and the embedded
engine score with; and in a mixture of experts, rollout routing replay (routing) with its metrics."""
