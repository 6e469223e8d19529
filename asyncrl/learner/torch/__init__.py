"""The plain-PyTorch learner (`fsdp2_train`): one process, or data-parallel ranks as Ray actors."""
