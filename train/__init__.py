"""torchrun entry points that train draft heads (`torchrun train/eagle.py --config configs/...`)."""
