"""CPU end-to-end tier for SGLang speculative decoding (test support only, never shipped).

Three pieces, all enabled only through the environment of a test process (see `env.py`):
- `shim/sgl_kernel`: an import shim for the CUDA-only `sgl_kernel` wheel plus pure-PyTorch `*_cpu` ops;
- `plugin/sglang_cpu_testing`: a general `sglang.srt.plugins` plugin with the CPU fixes of
  tests/sglang_cpu/README.md (found through its own `.dist-info`);
- `builders.py`: tiny Qwen3 target, tiny DSpark draft and the bigram draft;
  `server.py`: launch / query / stop a loopback SGLang server.
"""
