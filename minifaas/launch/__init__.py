"""Where workers come from: local child processes, hand-started workers, or Ray actors (``launcher``)."""
