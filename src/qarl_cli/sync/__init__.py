"""The sync stage: the trainer's new weights into the running engine, in place (`sync` group; base.py holds the
contract, inplace.py the stage).

    inplace.py          InplaceSync: what is sent (prequantized or online), the verify probe, the calibration
    lowbit_changes.py   how many low-bit weights a push changed (sync/lowbit_changed_*)
    weights.py          the checks every weight load goes through (names, shapes, dtypes, finite values)
    buckets.py          a push as checked bucket files, written before any engine hears of it
    checksums.py        the engines' /weight_checker digests against what was sent
    transfer.py         one push to every vLLM engine through vLLM's RL API, rolled back as a whole on failure
    backends.py         per engine a trainer-side transfer engine from vLLM's WeightTransferTrainerFactory
    client.py           the weights as vLLM's WeightSource, the engine's control plane as its weight-sync client
    shm.py, gloo.py     qarl's transfer backends, trainer and worker side each; nccl.py: vLLM's own
    group.py            the gloo group and its handshake

The torch engine takes a push as tensors (load_weights); vLLM engines, in this process or servers, through the
RL API. Nothing here imports vLLM at module level except the backend modules, which only a vLLM engine loads."""
