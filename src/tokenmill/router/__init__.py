"""tokenmill.router"""
