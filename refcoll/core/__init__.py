"""The core every layer shares: errors, ops, chunking, costs, bits, reading and writing."""
