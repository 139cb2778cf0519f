"""One forward pass over the flat batch: the model runner builds the step's tensors, attention reads
and writes the paged cache through a backend, the sampler picks the next tokens; on a GPU the step is
a CUDA graph replay (cuda_graph) over the Triton kernel (triton_attention)."""
