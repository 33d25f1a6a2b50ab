"""Training a drafter: ``trainer`` (the loop: steps, checkpoints, held-out evaluation), ``unit`` (what one step
trains: the drafter, or the drafter and a LoRA-adapted target), ``fsdp`` (FSDP2 sharding across processes),
``tracking`` (TensorBoard / W&B) and ``run_dir`` (the run directory: output rules, resume checks, run card).
"""
