"""Session files: ``kvtether gen`` (synthetic agent sessions) and ``kvtether convert`` (other tools' files)."""
