"""Operations on one machine: the embedded stack (`adaflash up/down/status`) and the demo that runs
the whole loop once against it (`adaflash demo`)."""
