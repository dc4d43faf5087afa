"""tokenmill.sim"""
