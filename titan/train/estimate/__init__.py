"""`titan plan`: a recipe's step on each rank at its real world size, traced on this CPU."""
