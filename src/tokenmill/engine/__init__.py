"""tokenmill.engine"""
