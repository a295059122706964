"""Launching `train.py` on several processes: locally on one machine (`local.py`, loopback and
fake CPU devices, what the tests use) and on GKE through XPK (`xpk.py`: the `xpk workload create`
command; `jobset.py`: a JobSet manifest for GPU node pools; `python -m MaxText.launch`)."""
