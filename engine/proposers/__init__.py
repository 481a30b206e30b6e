"""Draft proposers, one file per draft kind, behind the interface in :mod:`dflash_doctor.engine.proposers.base`."""
