"""The second token2wav: the Step-Audio-2-mini DiT flow (with real per-stream chunk caches) + HiFT."""
