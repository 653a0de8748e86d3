"""What every part of the project shares and none owns: files (atomic writes, locks, hashes),
checkpoints read without Lightning, and the choice of device and precision."""
