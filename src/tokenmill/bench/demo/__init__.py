"""The dashboard's scenarios under each toggle state."""
