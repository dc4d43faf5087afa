"""tokenmill.transfer"""
