"""twogrid's dispatcher: configuration resolution, capture grids and plans, and O(1) step dispatch."""
