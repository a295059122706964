"""A module fixture for test files whose oracle is transformers on a tiny model: torch on one
intra-op thread while the file runs. The models are too small for a second thread to pay, and
torch's OpenMP threads spin-wait between its many small ops: on a loaded 2-core machine that
spinning cost the file's transformers calls several times their own CPU seconds (a varying
amount: test_decode_parity's oracle ~15-45 s of CPU on two threads, ~1.5 s on one). The
previous count is restored for the worker's next file. Import it into the test module:
`from torch_threads import one_torch_thread  # noqa: F401`."""
import pytest


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    yield
    return
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    yield
  finally:
    torch.set_num_threads(threads)
