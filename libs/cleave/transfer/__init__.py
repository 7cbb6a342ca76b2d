"""cleave.transfer"""
