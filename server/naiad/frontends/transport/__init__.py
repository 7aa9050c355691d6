"""Transport plumbing all protocols share: receive buffers, eager starts, busy polling, heap trim, drain, TLS."""
