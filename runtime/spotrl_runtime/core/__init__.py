"""The recovery core: owners of every prompt, and the moves between them. Pure logic, no I/O."""
