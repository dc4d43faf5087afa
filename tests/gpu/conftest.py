"""Tests that need an NVIDIA GPU: collected only where torch sees one (on a CPU-only host they are
not collected, so nothing is skipped); everything they check on a GPU is checked on the CPU too,
through the same code run op by op (tests/engine/test_decode_graphs.py)."""
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
