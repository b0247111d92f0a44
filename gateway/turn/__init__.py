"""A turn on its way: identify → gather → plan → legs → relay → remember, and the bodies its legs send."""
