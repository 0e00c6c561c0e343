"""SMP v1 scripts as users wrote them (public AWS examples, SMP v1's own tests, the Hugging Face
Trainer's SMP path): their call shapes, on CPU and small, each launched under torchrun by
tests/torch/test_conformance.py. Only the import line, CUDA calls and data loading differ from the
originals."""
