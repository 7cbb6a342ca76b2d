"""cleave.model"""
