"""Sans-IO policies: plain synchronous decisions that the live system and the simulator share."""
