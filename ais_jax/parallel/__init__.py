"""The device mesh and the sharding rules (`sharding`). A leaf."""
