"""What a person sees: the product's console, progress bars and lines, and library output captured to a file."""
