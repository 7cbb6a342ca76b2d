"""Generated stubs of package cleave.v1 (protos/cleave/v1)."""
