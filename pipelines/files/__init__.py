"""Files on disk: atomic writes, paths kept inside their folder, hashing, YAML and JSON Lines."""
