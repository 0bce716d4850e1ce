"""Distributed stream-loading prefill with small expert parallelism (`num_gpus=N`, docs/hybrid.md).

The engine process is rank 0: it runs the whole model (attention, dense layers, routers, shared experts, decode).
It spawns N-1 worker ranks (`group.RankGroup`: processes it supervises, a torch.distributed process group, NCCL
between GPUs, gloo on the CPU stand-in). Every rank, rank 0 included, owns a contiguous 1/N of each MoE layer's
routed experts (`ownership`) and loads only those from the memory-mapped checkpoint (`share`). For a prefill
chunk each MoE layer's `ExpertParallelBackend` (`backend`, an ExpertBackend, so the MoE block is unchanged) sends
each worker the chunk's tokens that route to its experts, computes rank 0's own share meanwhile, and adds the
workers' partial outputs back (`exchange`: point-to-point messages, sizes first). `worker` is a worker rank's
main loop; `attach.attach_expert_parallel` wires it all onto a loaded model.
"""
