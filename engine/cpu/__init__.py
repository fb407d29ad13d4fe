"""fp32 CPU kernels: the fused C kernels (compiled on first use), the decoder layers that
call them, and oneDNN-prepacked linears."""
