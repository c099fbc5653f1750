"""Attention (chunkattn_server.attention): the chunk split, the triton kernels (under Triton's interpreter and
compiled for sm_90), the native CPU kernels' builds and fallback."""
