"""cleave.graphs"""
