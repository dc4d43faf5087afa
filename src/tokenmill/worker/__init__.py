"""tokenmill.worker"""
