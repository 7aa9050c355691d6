"""The HTTP/2 server: framing, HPACK blocks, connections and flow control, frames and messages read in."""
