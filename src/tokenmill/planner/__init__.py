"""tokenmill.planner"""
