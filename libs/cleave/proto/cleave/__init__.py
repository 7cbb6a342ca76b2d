"""Generated stubs of the cleave protos (protos/cleave)."""
