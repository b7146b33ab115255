"""The ``ascend`` target (:mod:`.target`): FIA lowering (:mod:`.lower`), its documented limits
(:mod:`.limits`), graph modes (:mod:`.graphs`) and TorchAir compilation (:mod:`.torchair`)."""
