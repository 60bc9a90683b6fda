"""The controller process: one per job, tying the recovery core to generation and training."""
