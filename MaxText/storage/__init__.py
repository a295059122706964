"""Where a run reads and writes: local paths or an object store (`gs://`, `s3://`), `paths`."""
