"""``kvtether assess``: the adopter's four questions answered on their own traffic (docs/assess.md)."""
