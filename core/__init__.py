"""What every part of the project shares and none owns: files, checkpoints, devices, the command line."""
