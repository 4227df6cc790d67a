"""The planning core: configuration, grids, capture plans and O(1) step dispatch. Pure Python: never imports
torch, so that ``twogrid plan`` answers in a fraction of a second on any machine."""
