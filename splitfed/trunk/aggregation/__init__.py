"""When and how client gradients update the trunk: sync, async, quorum, per-client, sequential."""
